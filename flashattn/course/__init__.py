"""The course's helpers: for the notebooks, the exercises' checkers, and where the course lives.

``notebook`` has ``show_source`` and ``pick(cpu=..., gpu=...)``; ``exercises`` the checkers, one
module per group of chapters; ``site`` names the course's repository once (the chapters' first
cell, the Colab links, the recorded data files); ``ring_runs`` what the ranks of chapter 13 run in
their processes, and how the chapter checks it.
"""

