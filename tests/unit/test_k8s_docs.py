"""docs/kubernetes.md's field table is the model's: regenerate with DPD_UPDATE_GOLDEN=1."""

import os
import re
from pathlib import Path

from dpd.k8s.fields import field_table, rows

DOC = Path("docs/kubernetes.md")
BLOCK = re.compile(r"(<!-- fields:begin -->\n)(.*?)(<!-- fields:end -->)", re.DOTALL)


def test_field_table_is_in_sync_with_the_model():
    text = DOC.read_text()
    if os.environ.get("DPD_UPDATE_GOLDEN"):
        DOC.write_text(BLOCK.sub(lambda m: m.group(1) + field_table() + m.group(3), text))
        text = DOC.read_text()
    assert BLOCK.search(text).group(2) == field_table(), "run with DPD_UPDATE_GOLDEN=1 to regenerate"


def test_every_pd_spec_field_is_explained():
    missing = [path for path, _, _, description in rows() if path.startswith("pdSpec.") and not description
               and not path.startswith(("pdSpec.local.", "pdSpec.kvCacheOffloadingSpec."))]
    assert missing == [], f"fields with no description in the model nor a cluster note: {missing}"
