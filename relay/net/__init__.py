"""The socket side: executors' WebSockets (the hub), uvicorn, and requests routed between instances."""
