"""Control-plane plumbing shared by the daemons, the client library and the CLI.

gRPC channels, servers and error mapping (:mod:`.rpc`), the daemons' HTTP endpoint (:mod:`.http`)
and start-up helpers (:mod:`.daemon`), the manager's client (:mod:`.manager_client`), the JSON
forms of the cluster status (:mod:`.status`) and following a preload (:mod:`.progress`).
"""
