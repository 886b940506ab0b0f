"""generated protobuf/gRPC code from proto/swarmtrain/wire (never edited; regenerate with scripts/gen_proto.sh)."""
