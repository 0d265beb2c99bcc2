"""The OpenAI-compatible HTTP server: app, request bodies, errors and one serving class per route
family."""
