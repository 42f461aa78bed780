"""Who holds what, as pure arithmetic (no torch): the rank order of the parallel degrees
(``ranks``), stage plans (``stage_plan``; an equal split is one too), where stages and their
replicas sit on pipeline ranks (``placement``), a plan's rank layout (``plan``) and how a layout
sits on nodes (``nodes``), how a stage's ranks fold into the experts' groups (``experts``), which tokens of a sequence each
context-parallel rank holds (``context``). Process
groups are built from these in ``megapipe.parallel``."""
