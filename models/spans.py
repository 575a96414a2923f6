"""The alphabet of the random spans that copy probes plant and training repeats.

One definition for every probe: training's planted repeats (`models.data`), the PyTorch copy probe
(`models.copy_probe`) and the service-side copy probe (`loadtest.probes`). A model that cannot copy
guesses a span's characters at chance, which is 1/len(alphabet). Standard library only: the Locust
image imports it without torch.
"""

from __future__ import annotations

import string

SPAN_ALPHABET = string.ascii_letters + string.digits  # order matters: training draws by index
SPAN_CHANCE = 1 / len(SPAN_ALPHABET)  # a guessed span character's chance of being right
