"""laneway's proxy: OpenAI-compatible routes, relay, backends, poller, metrics."""
