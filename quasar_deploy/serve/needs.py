"""What the server lets a request choose and so asks of its backend: constants the CLI reads without loading torch."""

# drafters a request may pick: "model" would need a server-side path, which a request must not choose
REQUEST_DRAFTERS = ("none", "ngram", "suffix", "layerskip")
# any request may ask for the layerskip drafter, so "auto" serves on a backend that can skip layers: on a CPU, ONNX
# Runtime's layer graphs of a W8A8 artifact (``onnx_layered``), else the cpu backend; both verify all requests' blocks
# in one batched forward
SERVER_NEEDS = ("layer_skip",)
