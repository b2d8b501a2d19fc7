"""One module per command: options -> evidence -> verdict -> `Report`."""
