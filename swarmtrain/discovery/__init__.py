"""the only importer of hivemind: typed signed records on the DHT, an in-memory twin for tests."""
