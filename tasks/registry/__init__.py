"""The draft registry: numbered versions of a draft, and the `current` one a server loads.

    <registry_dir> = <registry.path>/<name>/
        versions/<N>/    draft/ (the draft folder, copied), report.json and report.md (its validation),
                         lineage.json (where it came from, what it measured), serve.sh and serve.txt
        current          a symlink to versions/<N>, switched atomically
        history.jsonl    every promotion and rollback: time, from, to, why
        acceptance.png   τ across versions

    layout.py: the folders, `Version`, reading them
    -> register.py: a new version, written whole or not at all
    -> gate.py: whether a candidate may replace the current version
    -> promotion.py: promote, roll back (the atomic switch and its history)
    -> listing.py, picture.py: the table `eagle3-pipeline drafts list` prints, the picture

Plain functions, without Prefect; every change holds the registry's lock (tasks/common/folder_lock.py).
"""
