"""The provider service: serves named datasets on its own data socket, registered with the router."""
