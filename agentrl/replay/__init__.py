"""Looking back at stored episodes: ``agentrl replay`` (the list view and the terminal transcript).

``episodes`` finds a store, reads it with its damage reported (shard file and line), names each
episode (``<shard>:<line>``, stable when the store is copied elsewhere) and filters them;
``transcript`` renders them with rich.
"""
