"""One vLLM engine with ``ExampleConnector`` behind the canary connector, in a process of its own (vLLM's KV
transfer group is one per process): :func:`kvcanary_cupy.integrations.vllm.simulate_connector.run_engine` (the
spec it takes is described there), and a line starting with "RESULT " holding its result as JSON."""

from kvcanary_cupy.integrations.vllm.simulate_connector import main

if __name__ == "__main__":
    main()
