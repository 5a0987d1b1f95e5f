"""Re-render a ladder's report from its results.json with the current statistics code."""
import json, sys
from pathlib import Path
from dpd.bench.ladder import report
for d in sys.argv[1:]:
    results = json.loads((Path(d) / "results.json").read_text())
    (Path(d) / "report-rerendered.md").write_text(report(results))
    print("wrote", Path(d) / "report-rerendered.md")
