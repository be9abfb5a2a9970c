"""The serving engines tapdraft drives, one folder per job:

    serving/       what users run: an engine's venv, one serving job in a subprocess (``vllm_runner.py``, run inside
                   the vLLM venv), the requests and the checks (``tapdraft demo --real``, the benchmarks and the
                   engine tests use it)
    vllm_plugin/   what users install into their vLLM: the ``tapdraft_vllm`` model classes
    peers/         what only ``benchmarks.peers`` needs: the peer trainers' runners (ModelOpt, speculators)
    venv.sh, NAME.txt   one venv per engine, from its pins

The scripts the engine tests run inside the vLLM venv live with those tests (tests/engines/in_venv/); vLLM's part of
capture lives in capture/vllm/.
"""
