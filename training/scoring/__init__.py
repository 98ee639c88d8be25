"""Option scores and answers from whatever ``--model`` names, resolved once (``sources``):
a transformers model (``local``), an exported engine (``engine``) or a served model
(``served``, over ``endpoint``), cached on disk (``cache``); open-QA answers and their
P(True) judgements (``answers``, ``judgements``)."""
