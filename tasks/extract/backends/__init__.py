"""Hidden-state capture behind one interface (`load`, `capture`, `close`, `device`):
hf.py through transformers (any machine), vllm.py through vLLM's
`extract_hidden_states` (tensor parallel; vllm_connector.py is its connector on CPU).
"""
