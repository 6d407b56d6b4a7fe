"""The paper's four measurements on our server, in one run: `python -m prepos_loadtest.figures --out out/figures`.

a. first-token latency versus entry length (`prefix`, `prepaid`, `gated`) with the fitted cost model;
b. cost anatomy of the served paths at a representative entry length;
c. amortized first-token latency and pre-positioning energy versus the query-to-update ratio;
d. the gate's selective-prediction curve on BFCL sessions;
plus throughput beside the prefix-cache baseline. One module per figure; `__main__` runs them all.
"""
