"""What every stage uses: the configuration (config.py), which errors a retry cannot change
(errors.py) and how a command ends when refused (refusals.py), worker subprocesses and their progress files (workers.py), progress, rates and ETAs
(progress.py), one run per folder (folder_lock.py), append-only journals of finished work
(journal.py), the verifier read from its folder without loading it (verifier.py), what the
installed vLLM supports (vllm_support.py), the demo's model and data (demo_assets.py), Hugging Face
Hub ids as folders of its cache (hub.py) and the pictures of a run (plots.py). Nothing here imports
a stage.
"""
