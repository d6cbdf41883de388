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
SERVER_STATE_UNSPECIFIED: ServerState
SERVER_STATE_JOINING: ServerState
SERVER_STATE_READY: ServerState
SERVER_STATE_SUSPECT: ServerState
SERVER_STATE_FAILED: ServerState
SERVER_STATE_LEFT: ServerState

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
    __slots__ = ("hostname", "memory_bytes", "region_size", "cores", "transports", "nics", "memory_used_bytes")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGION_SIZE_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    memory_bytes: int
    region_size: int
    cores: int
    transports: _containers.RepeatedScalarFieldContainer[str]
    nics: _containers.RepeatedCompositeFieldContainer[Nic]
    memory_used_bytes: int
    def __init__(self, hostname: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., region_size: _Optional[int] = ..., cores: _Optional[int] = ..., transports: _Optional[_Iterable[str]] = ..., nics: _Optional[_Iterable[_Union[Nic, _Mapping]]] = ..., memory_used_bytes: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("id", "address", "http_address", "inventory", "version")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    http_address: str
    inventory: ServerInventory
    version: PeerVersion
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., http_address: _Optional[str] = ..., inventory: _Optional[_Union[ServerInventory, _Mapping]] = ..., version: _Optional[_Union[PeerVersion, _Mapping]] = ...) -> None: ...

class RegisterServerReply(_message.Message):
    __slots__ = ("incarnation", "protocol_version", "heartbeat_interval_s", "cluster_id")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    protocol_version: int
    heartbeat_interval_s: float
    cluster_id: str
    def __init__(self, incarnation: _Optional[int] = ..., protocol_version: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("id", "incarnation", "inventory")
    ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    id: str
    incarnation: int
    inventory: ServerInventory
    def __init__(self, id: _Optional[str] = ..., incarnation: _Optional[int] = ..., inventory: _Optional[_Union[ServerInventory, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("state", "heartbeat_interval_s")
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    state: ServerState
    heartbeat_interval_s: float
    def __init__(self, state: _Optional[_Union[ServerState, str]] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class DeregisterServerRequest(_message.Message):
    __slots__ = ("id", "incarnation", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    incarnation: int
    reason: str
    def __init__(self, id: _Optional[str] = ..., incarnation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class DeregisterServerReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListServersRequest(_message.Message):
    __slots__ = ("include_left",)
    INCLUDE_LEFT_FIELD_NUMBER: _ClassVar[int]
    include_left: bool
    def __init__(self, include_left: _Optional[bool] = ...) -> None: ...

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

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("cluster_id", "manager_version", "uptime_s", "servers", "revision")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    MANAGER_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    manager_version: str
    uptime_s: float
    servers: _containers.RepeatedCompositeFieldContainer[ServerRecord]
    revision: int
    def __init__(self, cluster_id: _Optional[str] = ..., manager_version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., servers: _Optional[_Iterable[_Union[ServerRecord, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("id", "inventory", "software_version", "protocol_versions", "manager_address", "registered", "incarnation")
    ID_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MANAGER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    id: str
    inventory: ServerInventory
    software_version: str
    protocol_versions: _containers.RepeatedScalarFieldContainer[int]
    manager_address: str
    registered: bool
    incarnation: int
    def __init__(self, id: _Optional[str] = ..., inventory: _Optional[_Union[ServerInventory, _Mapping]] = ..., software_version: _Optional[str] = ..., protocol_versions: _Optional[_Iterable[int]] = ..., manager_address: _Optional[str] = ..., registered: _Optional[bool] = ..., incarnation: _Optional[int] = ...) -> None: ...
