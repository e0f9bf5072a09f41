"""Engine parts the built-in backends share: requests, sampling, paged KV, scheduling."""
