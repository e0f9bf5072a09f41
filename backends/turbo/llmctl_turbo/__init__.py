"""llmctl's turbo backend: a native C++/CUDA engine built as a torch extension."""
