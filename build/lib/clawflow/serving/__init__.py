"""OpenAI-compatible gateway: protocol models, engines, session inference, router."""
