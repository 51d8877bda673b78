"""The REST transport, thin adapters to cache calls: ``api.create_app`` builds the
FastAPI app from the route modules (``namespaces``, ``chunks``, ``operations``,
``memories``), which share ``routing``; ``edge`` wraps every request (auth, body
limits, metrics, error bodies), ``models`` holds the bodies and ``server`` the uvicorn
server with the connection limits uvicorn lacks."""
