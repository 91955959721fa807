"""Stage 1, prepare: chat data -> verifier-tokenized `input_ids` and assistant-only loss masks.

    [regenerate.py: the verifier rewrites the answers (generators.py: transformers or vLLM)]
    -> chat_data.py: rows read and normalized -> chat_template.py: rendered by the verifier's
    template, only the assistant's text supervised -> stage.py: written, dropped rows counted

Hands on (dataset.py): a `datasets` folder under `prepared/<fingerprint>/` with its report, and a
`PreparedData` reference to it.
"""
