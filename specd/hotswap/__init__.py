"""Hot-swap: the versioned weight store, version sources (local store, MQTT announcements plus
HTTP fetches) and the swapper that follows the live version into a running drafter. Imports the
drafter, core and model layers below it; never the learner."""
