"""generated protobuf/gRPC code from proto/swarmtrain/wire (never edited; regenerate with scripts/gen_proto.sh).
One *_pb2.py (messages) and *_pb2_grpc.py (services) per proto file.
"""
