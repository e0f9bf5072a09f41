"""llmctl-openai-proxy: an llmctl backend that forwards generation to an OpenAI-compatible
server. ``plugin`` registers it; ``engine`` does the forwarding."""
