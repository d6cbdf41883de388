from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

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
    __slots__ = ("features", "protocol_versions", "software_version")
    PROTOCOL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_versions: _containers.RepeatedScalarFieldContainer[int]
    features: _containers.RepeatedScalarFieldContainer[str]
    software_version: str
    def __init__(self, protocol_versions: _Iterable[int] | None = ..., features: _Iterable[str] | None = ..., software_version: str | None = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("peer_name", "version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_NAME_FIELD_NUMBER: _ClassVar[int]
    version: PeerVersion
    peer_name: str
    def __init__(self, version: PeerVersion | _Mapping | None = ..., peer_name: str | None = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("cluster_id", "features", "manager_version", "protocol_version")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MANAGER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    features: _containers.RepeatedScalarFieldContainer[str]
    manager_version: str
    cluster_id: str
    def __init__(self, protocol_version: int | None = ..., features: _Iterable[str] | None = ..., manager_version: str | None = ..., cluster_id: str | None = ...) -> None: ...

class Nic(_message.Message):
    __slots__ = ("name", "numa_node", "pci_bus_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    pci_bus_id: str
    numa_node: int
    def __init__(self, name: str | None = ..., pci_bus_id: str | None = ..., numa_node: int | None = ...) -> None: ...

class ServerInventory(_message.Message):
    __slots__ = ("cores", "hostname", "memory_bytes", "memory_used_bytes", "nics", "region_size", "transports")
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
    def __init__(self, hostname: str | None = ..., memory_bytes: int | None = ..., region_size: int | None = ..., cores: int | None = ..., transports: _Iterable[str] | None = ..., nics: _Iterable[Nic | _Mapping] | None = ..., memory_used_bytes: int | None = ...) -> None: ...

class ServerRecord(_message.Message):
    __slots__ = ("address", "http_address", "id", "incarnation", "inventory", "last_heartbeat_unix", "protocol_version", "registered_unix", "software_version", "state", "state_reason")
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
    def __init__(self, id: str | None = ..., address: str | None = ..., http_address: str | None = ..., state: ServerState | str | None = ..., inventory: ServerInventory | _Mapping | None = ..., registered_unix: float | None = ..., last_heartbeat_unix: float | None = ..., incarnation: int | None = ..., protocol_version: int | None = ..., software_version: str | None = ..., state_reason: str | None = ...) -> None: ...

class RegisterServerRequest(_message.Message):
    __slots__ = ("address", "http_address", "id", "inventory", "version")
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
    def __init__(self, id: str | None = ..., address: str | None = ..., http_address: str | None = ..., inventory: ServerInventory | _Mapping | None = ..., version: PeerVersion | _Mapping | None = ...) -> None: ...

class RegisterServerReply(_message.Message):
    __slots__ = ("cluster_id", "heartbeat_interval_s", "incarnation", "protocol_version")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    protocol_version: int
    heartbeat_interval_s: float
    cluster_id: str
    def __init__(self, incarnation: int | None = ..., protocol_version: int | None = ..., heartbeat_interval_s: float | None = ..., cluster_id: str | None = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("id", "incarnation", "inventory")
    ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    id: str
    incarnation: int
    inventory: ServerInventory
    def __init__(self, id: str | None = ..., incarnation: int | None = ..., inventory: ServerInventory | _Mapping | None = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("heartbeat_interval_s", "state")
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    state: ServerState
    heartbeat_interval_s: float
    def __init__(self, state: ServerState | str | None = ..., heartbeat_interval_s: float | None = ...) -> None: ...

class DeregisterServerRequest(_message.Message):
    __slots__ = ("id", "incarnation", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    incarnation: int
    reason: str
    def __init__(self, id: str | None = ..., incarnation: int | None = ..., reason: str | None = ...) -> None: ...

class DeregisterServerReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListServersRequest(_message.Message):
    __slots__ = ("include_left",)
    INCLUDE_LEFT_FIELD_NUMBER: _ClassVar[int]
    include_left: bool
    def __init__(self, include_left: bool | None = ...) -> None: ...

class ListServersReply(_message.Message):
    __slots__ = ("revision", "servers")
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[ServerRecord]
    revision: int
    def __init__(self, servers: _Iterable[ServerRecord | _Mapping] | None = ..., revision: int | None = ...) -> None: ...

class WatchMembershipRequest(_message.Message):
    __slots__ = ("since_revision",)
    SINCE_REVISION_FIELD_NUMBER: _ClassVar[int]
    since_revision: int
    def __init__(self, since_revision: int | None = ...) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("revision", "servers", "snapshot")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    revision: int
    snapshot: bool
    servers: _containers.RepeatedCompositeFieldContainer[ServerRecord]
    def __init__(self, revision: int | None = ..., snapshot: bool | None = ..., servers: _Iterable[ServerRecord | _Mapping] | None = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("cluster_id", "manager_version", "revision", "servers", "uptime_s")
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
    def __init__(self, cluster_id: str | None = ..., manager_version: str | None = ..., uptime_s: float | None = ..., servers: _Iterable[ServerRecord | _Mapping] | None = ..., revision: int | None = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("id", "incarnation", "inventory", "manager_address", "protocol_versions", "registered", "software_version")
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
    def __init__(self, id: str | None = ..., inventory: ServerInventory | _Mapping | None = ..., software_version: str | None = ..., protocol_versions: _Iterable[int] | None = ..., manager_address: str | None = ..., registered: bool | None = ..., incarnation: int | None = ...) -> None: ...
