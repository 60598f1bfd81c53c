"""Sums the doctest summaries of a `meson test` run into one closing line.

Usage: count_tests.py TESTLOG_JSON [LABEL]   (LABEL, if given, prefixes the line: "LABEL: ...")

Each test binary prints "[doctest] test cases: T | P passed | F failed | S skipped".
A binary that printed no summary (it crashed or timed out) counts as one failed
case, so a crash can never look like a pass. Exits 1 when anything failed.
"""
import json
import re
import sys

SUMMARY = re.compile(r"\[doctest\] test cases:\s*\d+\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed\s*\|\s*(\d+) skipped")

passed = failed = skipped = 0
with open(sys.argv[1]) as log:
    for line in log:
        record = json.loads(line)
        output = record.get("stdout") or record.get("stdo") or ""  # the key differs across Meson versions
        found = SUMMARY.findall(output)
        if not found:
            print(f"{record['name']}: no doctest summary (result {record.get('result')})", file=sys.stderr)
            failed += 1
            continue
        p, f, s = map(int, found[-1])
        if f == 0 and record.get("result") not in ("OK", "EXPECTEDFAIL"):
            f = 1  # exited badly after its summary
        passed, failed, skipped = passed + p, failed + f, skipped + s
label = f"{sys.argv[2]}: " if len(sys.argv) > 2 else ""
print(f"{label}{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
