"""Generated protobuf/gRPC modules for proto/kspeed.proto (`make proto`; never edit by hand)."""
