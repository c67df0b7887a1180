"""The status hub every part of the core reports to (step records, exactness verdicts, status
sections, busy sources) and the typed records and document it keeps and builds."""
