"""The runtime: engine and sessions, the forward over backend ops, the backend contract, the KV
cache spec, configs, the compat matrix, the plugin manager and hooks, decoding / processor /
stopper bases."""
