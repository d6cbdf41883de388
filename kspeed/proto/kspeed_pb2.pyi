from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_STATE_UNSPECIFIED: _ClassVar[ServerState]
    SERVER_STATE_JOINING: _ClassVar[ServerState]
    SERVER_STATE_READY: _ClassVar[ServerState]
    SERVER_STATE_SUSPECT: _ClassVar[ServerState]
    SERVER_STATE_FAILED: _ClassVar[ServerState]
    SERVER_STATE_LEFT: _ClassVar[ServerState]
    SERVER_STATE_STOPPED: _ClassVar[ServerState]
    SERVER_STATE_DRAINING: _ClassVar[ServerState]

class DatasetOwner(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATASET_OWNER_UNSPECIFIED: _ClassVar[DatasetOwner]
    DATASET_OWNER_JOB: _ClassVar[DatasetOwner]
    DATASET_OWNER_OPERATOR: _ClassVar[DatasetOwner]

class DatasetState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATASET_STATE_UNSPECIFIED: _ClassVar[DatasetState]
    DATASET_STATE_ALLOCATED: _ClassVar[DatasetState]
    DATASET_STATE_LOADING: _ClassVar[DatasetState]
    DATASET_STATE_READY: _ClassVar[DatasetState]
    DATASET_STATE_DEGRADED: _ClassVar[DatasetState]
    DATASET_STATE_CHANGED: _ClassVar[DatasetState]
SERVER_STATE_UNSPECIFIED: ServerState
SERVER_STATE_JOINING: ServerState
SERVER_STATE_READY: ServerState
SERVER_STATE_SUSPECT: ServerState
SERVER_STATE_FAILED: ServerState
SERVER_STATE_LEFT: ServerState
SERVER_STATE_STOPPED: ServerState
SERVER_STATE_DRAINING: ServerState
DATASET_OWNER_UNSPECIFIED: DatasetOwner
DATASET_OWNER_JOB: DatasetOwner
DATASET_OWNER_OPERATOR: DatasetOwner
DATASET_STATE_UNSPECIFIED: DatasetState
DATASET_STATE_ALLOCATED: DatasetState
DATASET_STATE_LOADING: DatasetState
DATASET_STATE_READY: DatasetState
DATASET_STATE_DEGRADED: DatasetState
DATASET_STATE_CHANGED: DatasetState

class PeerVersion(_message.Message):
    __slots__ = ("protocol_versions", "features", "software_version")
    PROTOCOL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_versions: _containers.RepeatedScalarFieldContainer[int]
    features: _containers.RepeatedScalarFieldContainer[str]
    software_version: str
    def __init__(self, protocol_versions: _Optional[_Iterable[int]] = ..., features: _Optional[_Iterable[str]] = ..., software_version: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("version", "peer_name")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_NAME_FIELD_NUMBER: _ClassVar[int]
    version: PeerVersion
    peer_name: str
    def __init__(self, version: _Optional[_Union[PeerVersion, _Mapping]] = ..., peer_name: _Optional[str] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("protocol_version", "features", "manager_version", "cluster_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MANAGER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    features: _containers.RepeatedScalarFieldContainer[str]
    manager_version: str
    cluster_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., features: _Optional[_Iterable[str]] = ..., manager_version: _Optional[str] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class Nic(_message.Message):
    __slots__ = ("name", "pci_bus_id", "numa_node")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    pci_bus_id: str
    numa_node: int
    def __init__(self, name: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., numa_node: _Optional[int] = ...) -> None: ...

class ServerInventory(_message.Message):
    __slots__ = ("hostname", "memory_bytes", "region_size", "cores", "transports", "nics", "memory_used_bytes", "regions_total", "regions_free", "regions_allocated", "regions_filling", "regions_sealed", "regions_window", "libraries", "preprocess_workers", "preprocess_active", "preprocess_share", "preprocess_weights")
    class LibrariesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class PreprocessShareEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PreprocessWeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGION_SIZE_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FREE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FILLING_FIELD_NUMBER: _ClassVar[int]
    REGIONS_SEALED_FIELD_NUMBER: _ClassVar[int]
    REGIONS_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LIBRARIES_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_WORKERS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_SHARE_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    memory_bytes: int
    region_size: int
    cores: int
    transports: _containers.RepeatedScalarFieldContainer[str]
    nics: _containers.RepeatedCompositeFieldContainer[Nic]
    memory_used_bytes: int
    regions_total: int
    regions_free: int
    regions_allocated: int
    regions_filling: int
    regions_sealed: int
    regions_window: int
    libraries: _containers.ScalarMap[str, str]
    preprocess_workers: int
    preprocess_active: int
    preprocess_share: _containers.ScalarMap[str, float]
    preprocess_weights: _containers.ScalarMap[str, float]
    def __init__(self, hostname: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., region_size: _Optional[int] = ..., cores: _Optional[int] = ..., transports: _Optional[_Iterable[str]] = ..., nics: _Optional[_Iterable[_Union[Nic, _Mapping]]] = ..., memory_used_bytes: _Optional[int] = ..., regions_total: _Optional[int] = ..., regions_free: _Optional[int] = ..., regions_allocated: _Optional[int] = ..., regions_filling: _Optional[int] = ..., regions_sealed: _Optional[int] = ..., regions_window: _Optional[int] = ..., libraries: _Optional[_Mapping[str, str]] = ..., preprocess_workers: _Optional[int] = ..., preprocess_active: _Optional[int] = ..., preprocess_share: _Optional[_Mapping[str, float]] = ..., preprocess_weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ServerRecord(_message.Message):
    __slots__ = ("id", "address", "http_address", "state", "inventory", "registered_unix", "last_heartbeat_unix", "incarnation", "protocol_version", "software_version", "state_reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    http_address: str
    state: ServerState
    inventory: ServerInventory
    registered_unix: float
    last_heartbeat_unix: float
    incarnation: int
    protocol_version: int
    software_version: str
    state_reason: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., http_address: _Optional[str] = ..., state: _Optional[_Union[ServerState, str]] = ..., inventory: _Optional[_Union[ServerInventory, _Mapping]] = ..., registered_unix: _Optional[float] = ..., last_heartbeat_unix: _Optional[float] = ..., incarnation: _Optional[int] = ..., protocol_version: _Optional[int] = ..., software_version: _Optional[str] = ..., state_reason: _Optional[str] = ...) -> None: ...

class RegisterServerRequest(_message.Message):
    __slots__ = ("id", "address", "http_address", "inventory", "version", "cluster_id", "holding")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDING_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    http_address: str
    inventory: ServerInventory
    version: PeerVersion
    cluster_id: str
    holding: _containers.RepeatedCompositeFieldContainer[AssignShareRequest]
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., http_address: _Optional[str] = ..., inventory: _Optional[_Union[ServerInventory, _Mapping]] = ..., version: _Optional[_Union[PeerVersion, _Mapping]] = ..., cluster_id: _Optional[str] = ..., holding: _Optional[_Iterable[_Union[AssignShareRequest, _Mapping]]] = ...) -> None: ...

class RegisterServerReply(_message.Message):
    __slots__ = ("incarnation", "protocol_version", "heartbeat_interval_s", "cluster_id", "assignments")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    protocol_version: int
    heartbeat_interval_s: float
    cluster_id: str
    assignments: _containers.RepeatedCompositeFieldContainer[AssignShareRequest]
    def __init__(self, incarnation: _Optional[int] = ..., protocol_version: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., cluster_id: _Optional[str] = ..., assignments: _Optional[_Iterable[_Union[AssignShareRequest, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("id", "incarnation", "inventory", "shares")
    ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    id: str
    incarnation: int
    inventory: ServerInventory
    shares: _containers.RepeatedCompositeFieldContainer[ShareStatus]
    def __init__(self, id: _Optional[str] = ..., incarnation: _Optional[int] = ..., inventory: _Optional[_Union[ServerInventory, _Mapping]] = ..., shares: _Optional[_Iterable[_Union[ShareStatus, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("state", "heartbeat_interval_s", "drop_datasets", "drop_shares", "assign", "retire", "records")
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    DROP_DATASETS_FIELD_NUMBER: _ClassVar[int]
    DROP_SHARES_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    RETIRE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    state: ServerState
    heartbeat_interval_s: float
    drop_datasets: _containers.RepeatedScalarFieldContainer[str]
    drop_shares: _containers.RepeatedCompositeFieldContainer[ShareRef]
    assign: _containers.RepeatedCompositeFieldContainer[AssignShareRequest]
    retire: bool
    records: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, state: _Optional[_Union[ServerState, str]] = ..., heartbeat_interval_s: _Optional[float] = ..., drop_datasets: _Optional[_Iterable[str]] = ..., drop_shares: _Optional[_Iterable[_Union[ShareRef, _Mapping]]] = ..., assign: _Optional[_Iterable[_Union[AssignShareRequest, _Mapping]]] = ..., retire: _Optional[bool] = ..., records: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class DeregisterServerRequest(_message.Message):
    __slots__ = ("id", "incarnation", "reason", "keep_pool")
    ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KEEP_POOL_FIELD_NUMBER: _ClassVar[int]
    id: str
    incarnation: int
    reason: str
    keep_pool: bool
    def __init__(self, id: _Optional[str] = ..., incarnation: _Optional[int] = ..., reason: _Optional[str] = ..., keep_pool: _Optional[bool] = ...) -> None: ...

class DeregisterServerReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListServersRequest(_message.Message):
    __slots__ = ("include_left",)
    INCLUDE_LEFT_FIELD_NUMBER: _ClassVar[int]
    include_left: bool
    def __init__(self, include_left: _Optional[bool] = ...) -> None: ...

class DrainServerRequest(_message.Message):
    __slots__ = ("id", "allow_degraded")
    ID_FIELD_NUMBER: _ClassVar[int]
    ALLOW_DEGRADED_FIELD_NUMBER: _ClassVar[int]
    id: str
    allow_degraded: bool
    def __init__(self, id: _Optional[str] = ..., allow_degraded: _Optional[bool] = ...) -> None: ...

class ProbeAddressRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class ProbeAddressReply(_message.Message):
    __slots__ = ("serving", "detail")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    detail: str
    def __init__(self, serving: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class DrainServerReply(_message.Message):
    __slots__ = ("server", "shares")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    server: ServerRecord
    shares: _containers.RepeatedCompositeFieldContainer[ShareRef]
    def __init__(self, server: _Optional[_Union[ServerRecord, _Mapping]] = ..., shares: _Optional[_Iterable[_Union[ShareRef, _Mapping]]] = ...) -> None: ...

class ListServersReply(_message.Message):
    __slots__ = ("servers", "revision")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerRecord]
    revision: int
    def __init__(self, servers: _Optional[_Iterable[_Union[ServerRecord, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class WatchMembershipRequest(_message.Message):
    __slots__ = ("since_revision",)
    SINCE_REVISION_FIELD_NUMBER: _ClassVar[int]
    since_revision: int
    def __init__(self, since_revision: _Optional[int] = ...) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("revision", "snapshot", "servers")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    revision: int
    snapshot: bool
    servers: _containers.RepeatedCompositeFieldContainer[ServerRecord]
    def __init__(self, revision: _Optional[int] = ..., snapshot: _Optional[bool] = ..., servers: _Optional[_Iterable[_Union[ServerRecord, _Mapping]]] = ...) -> None: ...

class DatasetSpec(_message.Message):
    __slots__ = ("name", "uri", "kind", "labels", "quota_bytes", "pipeline", "cache", "policy")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    name: str
    uri: str
    kind: str
    labels: str
    quota_bytes: int
    pipeline: Pipeline
    cache: str
    policy: str
    def __init__(self, name: _Optional[str] = ..., uri: _Optional[str] = ..., kind: _Optional[str] = ..., labels: _Optional[str] = ..., quota_bytes: _Optional[int] = ..., pipeline: _Optional[_Union[Pipeline, _Mapping]] = ..., cache: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("shape", "dtype", "max_bytes", "kind")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    max_bytes: int
    kind: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., max_bytes: _Optional[int] = ..., kind: _Optional[str] = ...) -> None: ...

class Stage(_message.Message):
    __slots__ = ("op", "params", "output")
    OP_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    op: str
    params: str
    output: TensorSpec
    def __init__(self, op: _Optional[str] = ..., params: _Optional[str] = ..., output: _Optional[_Union[TensorSpec, _Mapping]] = ...) -> None: ...

class Pipeline(_message.Message):
    __slots__ = ("stages",)
    STAGES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[Stage]
    def __init__(self, stages: _Optional[_Iterable[_Union[Stage, _Mapping]]] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("count", "total_bytes", "digest")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    count: int
    total_bytes: int
    digest: str
    def __init__(self, count: _Optional[int] = ..., total_bytes: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class Share(_message.Message):
    __slots__ = ("server_id", "first_id", "end_id", "first_region", "num_regions", "bytes", "on_demand", "policy", "memory_regions", "slice_bytes", "handoff_to")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    END_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_REGION_FIELD_NUMBER: _ClassVar[int]
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ON_DEMAND_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_REGIONS_FIELD_NUMBER: _ClassVar[int]
    SLICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TO_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    first_id: int
    end_id: int
    first_region: int
    num_regions: int
    bytes: int
    on_demand: bool
    policy: str
    memory_regions: int
    slice_bytes: int
    handoff_to: str
    def __init__(self, server_id: _Optional[str] = ..., first_id: _Optional[int] = ..., end_id: _Optional[int] = ..., first_region: _Optional[int] = ..., num_regions: _Optional[int] = ..., bytes: _Optional[int] = ..., on_demand: _Optional[bool] = ..., policy: _Optional[str] = ..., memory_regions: _Optional[int] = ..., slice_bytes: _Optional[int] = ..., handoff_to: _Optional[str] = ...) -> None: ...

class ShareRef(_message.Message):
    __slots__ = ("dataset", "first_id")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    first_id: int
    def __init__(self, dataset: _Optional[str] = ..., first_id: _Optional[int] = ...) -> None: ...

class PreloadProgress(_message.Message):
    __slots__ = ("samples_loaded", "samples_total", "bytes_loaded", "bytes_total", "bytes_per_s", "running", "error_count", "errors", "samples_read")
    SAMPLES_LOADED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    ERROR_COUNT_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_READ_FIELD_NUMBER: _ClassVar[int]
    samples_loaded: int
    samples_total: int
    bytes_loaded: int
    bytes_total: int
    bytes_per_s: float
    running: bool
    error_count: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    samples_read: int
    def __init__(self, samples_loaded: _Optional[int] = ..., samples_total: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., bytes_total: _Optional[int] = ..., bytes_per_s: _Optional[float] = ..., running: _Optional[bool] = ..., error_count: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ..., samples_read: _Optional[int] = ...) -> None: ...

class ShareStatus(_message.Message):
    __slots__ = ("dataset", "progress", "regions_sealed", "integrity_repairs", "changed_samples", "changes", "samples_checked", "stage_seconds", "first_id", "epochs", "revision")
    class StageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_SEALED_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_REPAIRS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    progress: PreloadProgress
    regions_sealed: int
    integrity_repairs: int
    changed_samples: int
    changes: _containers.RepeatedScalarFieldContainer[str]
    samples_checked: int
    stage_seconds: _containers.ScalarMap[str, float]
    first_id: int
    epochs: _containers.RepeatedCompositeFieldContainer[EpochFigures]
    revision: int
    def __init__(self, dataset: _Optional[str] = ..., progress: _Optional[_Union[PreloadProgress, _Mapping]] = ..., regions_sealed: _Optional[int] = ..., integrity_repairs: _Optional[int] = ..., changed_samples: _Optional[int] = ..., changes: _Optional[_Iterable[str]] = ..., samples_checked: _Optional[int] = ..., stage_seconds: _Optional[_Mapping[str, float]] = ..., first_id: _Optional[int] = ..., epochs: _Optional[_Iterable[_Union[EpochFigures, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class EpochFigures(_message.Message):
    __slots__ = ("epoch", "planned", "written", "misses", "backend_bytes", "backend_requests", "stall_s")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    planned: int
    written: int
    misses: int
    backend_bytes: int
    backend_requests: int
    stall_s: float
    def __init__(self, epoch: _Optional[int] = ..., planned: _Optional[int] = ..., written: _Optional[int] = ..., misses: _Optional[int] = ..., backend_bytes: _Optional[int] = ..., backend_requests: _Optional[int] = ..., stall_s: _Optional[float] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("id", "dataset", "holder", "ttl_s", "expires_unix")
    ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    id: str
    dataset: str
    holder: str
    ttl_s: float
    expires_unix: float
    def __init__(self, id: _Optional[str] = ..., dataset: _Optional[str] = ..., holder: _Optional[str] = ..., ttl_s: _Optional[float] = ..., expires_unix: _Optional[float] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("spec", "owner", "state", "fingerprint", "region_size", "shares", "progress", "share_status", "class_names", "leases", "created_unix", "server_addresses", "changes", "changed_reason", "sample_dtype", "sample_shape", "shard_starts", "revision")
    class ServerAddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SPEC_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REGION_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    SHARE_STATUS_FIELD_NUMBER: _ClassVar[int]
    CLASS_NAMES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SERVER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    CHANGED_REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHARD_STARTS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    spec: DatasetSpec
    owner: DatasetOwner
    state: DatasetState
    fingerprint: Fingerprint
    region_size: int
    shares: _containers.RepeatedCompositeFieldContainer[Share]
    progress: PreloadProgress
    share_status: _containers.RepeatedCompositeFieldContainer[ShareStatus]
    class_names: _containers.RepeatedScalarFieldContainer[str]
    leases: int
    created_unix: float
    server_addresses: _containers.ScalarMap[str, str]
    changes: _containers.RepeatedScalarFieldContainer[str]
    changed_reason: str
    sample_dtype: str
    sample_shape: _containers.RepeatedScalarFieldContainer[int]
    shard_starts: bytes
    revision: int
    def __init__(self, spec: _Optional[_Union[DatasetSpec, _Mapping]] = ..., owner: _Optional[_Union[DatasetOwner, str]] = ..., state: _Optional[_Union[DatasetState, str]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., region_size: _Optional[int] = ..., shares: _Optional[_Iterable[_Union[Share, _Mapping]]] = ..., progress: _Optional[_Union[PreloadProgress, _Mapping]] = ..., share_status: _Optional[_Iterable[_Union[ShareStatus, _Mapping]]] = ..., class_names: _Optional[_Iterable[str]] = ..., leases: _Optional[int] = ..., created_unix: _Optional[float] = ..., server_addresses: _Optional[_Mapping[str, str]] = ..., changes: _Optional[_Iterable[str]] = ..., changed_reason: _Optional[str] = ..., sample_dtype: _Optional[str] = ..., sample_shape: _Optional[_Iterable[int]] = ..., shard_starts: _Optional[bytes] = ..., revision: _Optional[int] = ...) -> None: ...

class CreateDatasetRequest(_message.Message):
    __slots__ = ("spec", "owner", "holder", "lease_ttl_s")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    spec: DatasetSpec
    owner: DatasetOwner
    holder: str
    lease_ttl_s: float
    def __init__(self, spec: _Optional[_Union[DatasetSpec, _Mapping]] = ..., owner: _Optional[_Union[DatasetOwner, str]] = ..., holder: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class CreateDatasetReply(_message.Message):
    __slots__ = ("dataset", "created", "lease")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetInfo
    created: bool
    lease: Lease
    def __init__(self, dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ..., created: _Optional[bool] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class DatasetRequest(_message.Message):
    __slots__ = ("name", "first_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    first_id: int
    def __init__(self, name: _Optional[str] = ..., first_id: _Optional[int] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsReply(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class RemoveDatasetRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class RemoveDatasetReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckShareRequest(_message.Message):
    __slots__ = ("name", "limit", "attach")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    name: str
    limit: int
    attach: bool
    def __init__(self, name: _Optional[str] = ..., limit: _Optional[int] = ..., attach: _Optional[bool] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AssignShareRequest(_message.Message):
    __slots__ = ("spec", "fingerprint", "region_size", "share", "dataset", "listing")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REGION_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    LISTING_FIELD_NUMBER: _ClassVar[int]
    spec: DatasetSpec
    fingerprint: Fingerprint
    region_size: int
    share: Share
    dataset: DatasetInfo
    listing: ListingSource
    def __init__(self, spec: _Optional[_Union[DatasetSpec, _Mapping]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., region_size: _Optional[int] = ..., share: _Optional[_Union[Share, _Mapping]] = ..., dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ..., listing: _Optional[_Union[ListingSource, _Mapping]] = ...) -> None: ...

class DescribeDatasetReply(_message.Message):
    __slots__ = ("fingerprint", "class_names", "region_size", "region_starts", "region_bytes", "sample_dtype", "sample_shape", "shard_starts", "listing_id")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CLASS_NAMES_FIELD_NUMBER: _ClassVar[int]
    REGION_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGION_STARTS_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHARD_STARTS_FIELD_NUMBER: _ClassVar[int]
    LISTING_ID_FIELD_NUMBER: _ClassVar[int]
    fingerprint: Fingerprint
    class_names: _containers.RepeatedScalarFieldContainer[str]
    region_size: int
    region_starts: bytes
    region_bytes: bytes
    sample_dtype: str
    sample_shape: _containers.RepeatedScalarFieldContainer[int]
    shard_starts: bytes
    listing_id: str
    def __init__(self, fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., class_names: _Optional[_Iterable[str]] = ..., region_size: _Optional[int] = ..., region_starts: _Optional[bytes] = ..., region_bytes: _Optional[bytes] = ..., sample_dtype: _Optional[str] = ..., sample_shape: _Optional[_Iterable[int]] = ..., shard_starts: _Optional[bytes] = ..., listing_id: _Optional[str] = ...) -> None: ...

class ListingSource(_message.Message):
    __slots__ = ("server_id", "address", "listing_id")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LISTING_ID_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    listing_id: str
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., listing_id: _Optional[str] = ...) -> None: ...

class FetchListingRequest(_message.Message):
    __slots__ = ("listing_id",)
    LISTING_ID_FIELD_NUMBER: _ClassVar[int]
    listing_id: str
    def __init__(self, listing_id: _Optional[str] = ...) -> None: ...

class ListingArray(_message.Message):
    __slots__ = ("name", "dtype", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ListingHeader(_message.Message):
    __slots__ = ("kind", "root", "fingerprint", "classes", "shards", "row_offset", "file_stamp", "dtype", "row_shape", "arrays")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FILE_STAMP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROW_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    root: str
    fingerprint: Fingerprint
    classes: _containers.RepeatedScalarFieldContainer[str]
    shards: _containers.RepeatedScalarFieldContainer[str]
    row_offset: int
    file_stamp: float
    dtype: str
    row_shape: _containers.RepeatedScalarFieldContainer[int]
    arrays: _containers.RepeatedCompositeFieldContainer[ListingArray]
    def __init__(self, kind: _Optional[str] = ..., root: _Optional[str] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., classes: _Optional[_Iterable[str]] = ..., shards: _Optional[_Iterable[str]] = ..., row_offset: _Optional[int] = ..., file_stamp: _Optional[float] = ..., dtype: _Optional[str] = ..., row_shape: _Optional[_Iterable[int]] = ..., arrays: _Optional[_Iterable[_Union[ListingArray, _Mapping]]] = ...) -> None: ...

class ListingChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ListingHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ListingHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DropDatasetReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("dataset", "ids", "first_id")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    ids: bytes
    first_id: int
    def __init__(self, dataset: _Optional[str] = ..., ids: _Optional[bytes] = ..., first_id: _Optional[int] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("positions", "lengths", "labels")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    positions: bytes
    lengths: bytes
    labels: bytes
    def __init__(self, positions: _Optional[bytes] = ..., lengths: _Optional[bytes] = ..., labels: _Optional[bytes] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("dataset", "ids")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    ids: bytes
    def __init__(self, dataset: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class ReadReply(_message.Message):
    __slots__ = ("data", "lengths")
    DATA_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    lengths: bytes
    def __init__(self, data: _Optional[bytes] = ..., lengths: _Optional[bytes] = ...) -> None: ...

class OpenFeedRequest(_message.Message):
    __slots__ = ("dataset", "feed_id", "rail", "material", "ring_key", "generation", "holder", "first_id", "ranks", "job", "group", "member", "share", "group_lag")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    RAIL_FIELD_NUMBER: _ClassVar[int]
    MATERIAL_FIELD_NUMBER: _ClassVar[int]
    RING_KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    FIRST_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    GROUP_LAG_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    feed_id: str
    rail: str
    material: bytes
    ring_key: bytes
    generation: int
    holder: str
    first_id: int
    ranks: int
    job: str
    group: str
    member: str
    share: str
    group_lag: int
    def __init__(self, dataset: _Optional[str] = ..., feed_id: _Optional[str] = ..., rail: _Optional[str] = ..., material: _Optional[bytes] = ..., ring_key: _Optional[bytes] = ..., generation: _Optional[int] = ..., holder: _Optional[str] = ..., first_id: _Optional[int] = ..., ranks: _Optional[int] = ..., job: _Optional[str] = ..., group: _Optional[str] = ..., member: _Optional[str] = ..., share: _Optional[str] = ..., group_lag: _Optional[int] = ...) -> None: ...

class Position(_message.Message):
    __slots__ = ("dataset", "job", "world_size", "rank", "state")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    job: str
    world_size: int
    rank: int
    state: bytes
    def __init__(self, dataset: _Optional[str] = ..., job: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., state: _Optional[bytes] = ...) -> None: ...

class KeepPositionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PositionsRequest(_message.Message):
    __slots__ = ("dataset", "job")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    job: str
    def __init__(self, dataset: _Optional[str] = ..., job: _Optional[str] = ...) -> None: ...

class PositionsReply(_message.Message):
    __slots__ = ("positions",)
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedCompositeFieldContainer[Position]
    def __init__(self, positions: _Optional[_Iterable[_Union[Position, _Mapping]]] = ...) -> None: ...

class OpenFeedReply(_message.Message):
    __slots__ = ("server_id", "feeder")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    FEEDER_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    feeder: int
    def __init__(self, server_id: _Optional[str] = ..., feeder: _Optional[int] = ...) -> None: ...

class PlanChunk(_message.Message):
    __slots__ = ("feed_id", "epoch", "batch_size", "ids", "lengths", "remote", "server_stages", "seed", "seed_epoch", "skip_failed", "first_batch", "count", "positions", "offsets")
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    SERVER_STAGES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SKIP_FAILED_FIELD_NUMBER: _ClassVar[int]
    FIRST_BATCH_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    feed_id: str
    epoch: int
    batch_size: int
    ids: bytes
    lengths: bytes
    remote: bytes
    server_stages: int
    seed: int
    seed_epoch: int
    skip_failed: bool
    first_batch: int
    count: int
    positions: bytes
    offsets: bytes
    def __init__(self, feed_id: _Optional[str] = ..., epoch: _Optional[int] = ..., batch_size: _Optional[int] = ..., ids: _Optional[bytes] = ..., lengths: _Optional[bytes] = ..., remote: _Optional[bytes] = ..., server_stages: _Optional[int] = ..., seed: _Optional[int] = ..., seed_epoch: _Optional[int] = ..., skip_failed: _Optional[bool] = ..., first_batch: _Optional[int] = ..., count: _Optional[int] = ..., positions: _Optional[bytes] = ..., offsets: _Optional[bytes] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("owned", "owned_bytes")
    OWNED_FIELD_NUMBER: _ClassVar[int]
    OWNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    owned: int
    owned_bytes: int
    def __init__(self, owned: _Optional[int] = ..., owned_bytes: _Optional[int] = ...) -> None: ...

class CloseFeedRequest(_message.Message):
    __slots__ = ("feed_id",)
    FEED_ID_FIELD_NUMBER: _ClassVar[int]
    feed_id: str
    def __init__(self, feed_id: _Optional[str] = ...) -> None: ...

class CloseFeedReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStats(_message.Message):
    __slots__ = ("job", "rank", "world_size", "host", "pid", "dataset", "batches", "samples", "bytes", "elapsed_s", "wait_total_s", "wait_mean_ms", "wait_p50_ms", "wait_p99_ms", "wait_max_ms", "server_bytes", "stale_completions", "report_unix", "offload_ratio", "offload_reason", "blocked", "step_s")
    class ServerBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MAX_MS_FIELD_NUMBER: _ClassVar[int]
    SERVER_BYTES_FIELD_NUMBER: _ClassVar[int]
    STALE_COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    REPORT_UNIX_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_RATIO_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    host: str
    pid: int
    dataset: str
    batches: int
    samples: int
    bytes: int
    elapsed_s: float
    wait_total_s: float
    wait_mean_ms: float
    wait_p50_ms: float
    wait_p99_ms: float
    wait_max_ms: float
    server_bytes: _containers.ScalarMap[str, int]
    stale_completions: int
    report_unix: float
    offload_ratio: float
    offload_reason: str
    blocked: _containers.RepeatedCompositeFieldContainer[BlockedSeconds]
    step_s: float
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., dataset: _Optional[str] = ..., batches: _Optional[int] = ..., samples: _Optional[int] = ..., bytes: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., wait_total_s: _Optional[float] = ..., wait_mean_ms: _Optional[float] = ..., wait_p50_ms: _Optional[float] = ..., wait_p99_ms: _Optional[float] = ..., wait_max_ms: _Optional[float] = ..., server_bytes: _Optional[_Mapping[str, int]] = ..., stale_completions: _Optional[int] = ..., report_unix: _Optional[float] = ..., offload_ratio: _Optional[float] = ..., offload_reason: _Optional[str] = ..., blocked: _Optional[_Iterable[_Union[BlockedSeconds, _Mapping]]] = ..., step_s: _Optional[float] = ...) -> None: ...

class BlockedSeconds(_message.Message):
    __slots__ = ("cause", "server", "stage", "seconds")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    cause: str
    server: str
    stage: str
    seconds: float
    def __init__(self, cause: _Optional[str] = ..., server: _Optional[str] = ..., stage: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class ReportStatsReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobRequest(_message.Message):
    __slots__ = ("job", "history")
    JOB_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    job: str
    history: bool
    def __init__(self, job: _Optional[str] = ..., history: _Optional[bool] = ...) -> None: ...

class RankSample(_message.Message):
    __slots__ = ("report_unix", "wait_total_s", "step_s", "blocked")
    REPORT_UNIX_FIELD_NUMBER: _ClassVar[int]
    WAIT_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    report_unix: float
    wait_total_s: float
    step_s: float
    blocked: _containers.RepeatedCompositeFieldContainer[BlockedSeconds]
    def __init__(self, report_unix: _Optional[float] = ..., wait_total_s: _Optional[float] = ..., step_s: _Optional[float] = ..., blocked: _Optional[_Iterable[_Union[BlockedSeconds, _Mapping]]] = ...) -> None: ...

class RankHistory(_message.Message):
    __slots__ = ("rank", "dataset", "samples")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    dataset: str
    samples: _containers.RepeatedCompositeFieldContainer[RankSample]
    def __init__(self, rank: _Optional[int] = ..., dataset: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[RankSample, _Mapping]]] = ...) -> None: ...

class JobBlocked(_message.Message):
    __slots__ = ("cause", "server", "seconds")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    cause: str
    server: str
    seconds: float
    def __init__(self, cause: _Optional[str] = ..., server: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class Spread(_message.Message):
    __slots__ = ("min", "max", "p50", "p99")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    min: float
    max: float
    p50: float
    p99: float
    def __init__(self, min: _Optional[float] = ..., max: _Optional[float] = ..., p50: _Optional[float] = ..., p99: _Optional[float] = ...) -> None: ...

class JobStats(_message.Message):
    __slots__ = ("job", "ranks", "wait_mean_ms", "wait_p99_ms", "samples_per_s", "blocked", "history")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    job: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankStats]
    wait_mean_ms: Spread
    wait_p99_ms: Spread
    samples_per_s: Spread
    blocked: _containers.RepeatedCompositeFieldContainer[JobBlocked]
    history: _containers.RepeatedCompositeFieldContainer[RankHistory]
    def __init__(self, job: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankStats, _Mapping]]] = ..., wait_mean_ms: _Optional[_Union[Spread, _Mapping]] = ..., wait_p99_ms: _Optional[_Union[Spread, _Mapping]] = ..., samples_per_s: _Optional[_Union[Spread, _Mapping]] = ..., blocked: _Optional[_Iterable[_Union[JobBlocked, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[RankHistory, _Mapping]]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, jobs: _Optional[_Iterable[str]] = ...) -> None: ...

class TuningRequest(_message.Message):
    __slots__ = ("dataset", "model")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    model: str
    def __init__(self, dataset: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class TuningRecord(_message.Message):
    __slots__ = ("dataset", "model", "ratio", "server_stages", "rates", "reason", "updated_unix", "key")
    class RatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DATASET_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    SERVER_STAGES_FIELD_NUMBER: _ClassVar[int]
    RATES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    model: str
    ratio: float
    server_stages: int
    rates: _containers.ScalarMap[str, float]
    reason: str
    updated_unix: float
    key: str
    def __init__(self, dataset: _Optional[str] = ..., model: _Optional[str] = ..., ratio: _Optional[float] = ..., server_stages: _Optional[int] = ..., rates: _Optional[_Mapping[str, float]] = ..., reason: _Optional[str] = ..., updated_unix: _Optional[float] = ..., key: _Optional[str] = ...) -> None: ...

class SaveTuningReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("cluster_id", "manager_version", "uptime_s", "servers", "revision", "datasets")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    MANAGER_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    manager_version: str
    uptime_s: float
    servers: _containers.RepeatedCompositeFieldContainer[ServerRecord]
    revision: int
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, cluster_id: _Optional[str] = ..., manager_version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., servers: _Optional[_Iterable[_Union[ServerRecord, _Mapping]]] = ..., revision: _Optional[int] = ..., datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ("job", "dataset")
    JOB_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    job: str
    dataset: str
    def __init__(self, job: _Optional[str] = ..., dataset: _Optional[str] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("id", "inventory", "software_version", "protocol_versions", "manager_address", "registered", "incarnation", "prep", "production")
    ID_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MANAGER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PREP_FIELD_NUMBER: _ClassVar[int]
    PRODUCTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    inventory: ServerInventory
    software_version: str
    protocol_versions: _containers.RepeatedScalarFieldContainer[int]
    manager_address: str
    registered: bool
    incarnation: int
    prep: PrepFigures
    production: ProductionFigures
    def __init__(self, id: _Optional[str] = ..., inventory: _Optional[_Union[ServerInventory, _Mapping]] = ..., software_version: _Optional[str] = ..., protocol_versions: _Optional[_Iterable[int]] = ..., manager_address: _Optional[str] = ..., registered: _Optional[bool] = ..., incarnation: _Optional[int] = ..., prep: _Optional[_Union[PrepFigures, _Mapping]] = ..., production: _Optional[_Union[ProductionFigures, _Mapping]] = ...) -> None: ...

class ProductionFigures(_message.Message):
    __slots__ = ("fetch_seconds", "stage_seconds", "fetch_samples", "fetch_bytes", "groups")
    class StageSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FETCH_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    fetch_seconds: float
    stage_seconds: _containers.ScalarMap[str, float]
    fetch_samples: int
    fetch_bytes: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupFigures]
    def __init__(self, fetch_seconds: _Optional[float] = ..., stage_seconds: _Optional[_Mapping[str, float]] = ..., fetch_samples: _Optional[int] = ..., fetch_bytes: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupFigures, _Mapping]]] = ...) -> None: ...

class GroupFigures(_message.Message):
    __slots__ = ("group", "produced", "shared", "alone", "evicted", "held_bytes", "kept_bytes", "cap_bytes", "members", "member_shared", "member_alone", "member_produced")
    class MemberSharedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MemberAloneEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MemberProducedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_SHARED_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ALONE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_PRODUCED_FIELD_NUMBER: _ClassVar[int]
    group: str
    produced: int
    shared: int
    alone: int
    evicted: int
    held_bytes: int
    kept_bytes: int
    cap_bytes: int
    members: int
    member_shared: _containers.ScalarMap[str, int]
    member_alone: _containers.ScalarMap[str, int]
    member_produced: _containers.ScalarMap[str, int]
    def __init__(self, group: _Optional[str] = ..., produced: _Optional[int] = ..., shared: _Optional[int] = ..., alone: _Optional[int] = ..., evicted: _Optional[int] = ..., held_bytes: _Optional[int] = ..., kept_bytes: _Optional[int] = ..., cap_bytes: _Optional[int] = ..., members: _Optional[int] = ..., member_shared: _Optional[_Mapping[str, int]] = ..., member_alone: _Optional[_Mapping[str, int]] = ..., member_produced: _Optional[_Mapping[str, int]] = ...) -> None: ...

class PrepFigures(_message.Message):
    __slots__ = ("workers", "busy_seconds", "samples", "cpu_seconds", "daemon_cpu_seconds", "cores", "cpu_group", "job_samples")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    CPU_GROUP_FIELD_NUMBER: _ClassVar[int]
    JOB_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    workers: int
    busy_seconds: float
    samples: int
    cpu_seconds: float
    daemon_cpu_seconds: float
    cores: int
    cpu_group: str
    job_samples: int
    def __init__(self, workers: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., samples: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., daemon_cpu_seconds: _Optional[float] = ..., cores: _Optional[int] = ..., cpu_group: _Optional[str] = ..., job_samples: _Optional[int] = ...) -> None: ...
