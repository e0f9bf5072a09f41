"""llmctl-transformers: an llmctl backend around transformers' continuous-batching engine.
``plugin`` registers it; ``engine`` runs it; ``sampling`` and ``support`` say what it can do."""
