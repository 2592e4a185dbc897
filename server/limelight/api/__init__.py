"""gRPC edge: servicer (message conversion only), interceptors, server bootstrap."""
