"""Usage billing: an append-only ledger (SQLite or PostgreSQL) with per-app price books and monthly reports.

Entry points: ``recorder.UsageRecorder`` (request-path recording through a local journal),
``call_facts.event_from_facts`` (one attempt's ``CallFacts`` → ``events.UsageEvent``),
``litellm_events.event_from_callback`` (LiteLLM callback payload → facts → event), ``attribution`` (the request's
app), ``ledger.Ledger``,
``periods.close_period``, ``reports``; the ``kvroute billing`` / ``kvroute report`` commands live in ``cli``.
"""
