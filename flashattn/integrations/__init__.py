"""flashattn inside other libraries: adapters that let a model library call the public ops.

Each module here sits on top of ``flashattn.attention``, ``flashattn.varlen_attention`` and
``flashattn.decode`` and speaks one library's calling convention, so that a model written for that
library runs on the course's kernels without a change to the model. ``transformers`` registers an
attention function (and its mask function) with Hugging Face transformers' ``AttentionInterface``.

The libraries stay optional: importing ``flashattn`` never imports this layer, and a module here
imports its library only when it is imported itself.
"""
