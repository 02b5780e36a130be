"""The loader (libbus/loader, libbus/order): RemoteLoader, its request window, flows, order, elastic ranks, stalls."""
