"""Timelines: an episode's LLM calls merged, token-exact, into few training samples.

The package's parts, each importing only the ones above it:
- `jet.timeline.model`: `Call`, `Episode`, `Sample` and their invariants, and the declaration of a
  Sample's per-token columns (`Column`, `COLUMNS`) that the rest of Jet derives from;
- `jet.timeline.tree`: the prefix tree of `tree` mode;
- `jet.timeline.merge`: `merge_calls` / `merge_episodes` (modes `none`, `exact`, `tree`);
- `jet.timeline.split`: `split_sample` / `truncate_sample`, cutting a sample to a token budget.
The proof that merging is exact is in docs/design.md, "Timelines".
"""

from jet.timeline.merge import merge_calls, merge_episodes
from jet.timeline.model import COLUMNS, MODES, Call, Column, Episode, Mode, Sample
from jet.timeline.split import split_sample, truncate_sample

__all__ = ["COLUMNS", "MODES", "Call", "Column", "Episode", "Mode", "Sample", "merge_calls", "merge_episodes",
           "split_sample", "truncate_sample"]
