"""What the server lets a request choose and so asks of its backend: constants the CLI reads without loading torch."""

REQUEST_DRAFTERS = ("none", "ngram", "suffix", "layerskip")  # not "model": a request must not choose a server-side path
SERVER_NEEDS = ("layer_skip",)  # any request may ask for layerskip, so "auto" serves on a backend that can skip layers
