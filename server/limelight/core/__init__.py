"""The explanation service and its domain types. Never imports grpc."""
