"""The front-end's link to the engine-core process: starting it and talking to it."""
