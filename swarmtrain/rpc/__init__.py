"""the only importer of grpc: servers, clients, deadlines, retries, chunked streams."""
