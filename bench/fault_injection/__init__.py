"""The fault-injection suite behind bench/faults.py (its entry point and the suite's description):
- stages: the small real inputs, the uninterrupted references and each stage run as a process;
- outputs: what a fault left, and whether the re-run's output equals the uninterrupted run's;
- kinds: the trial kinds (kills, damaged files, full disks, two runs at once) and their Trial record;
- report: the summary table, docs/RELIABILITY.md's figures, and reading earlier runs' logs.
"""
