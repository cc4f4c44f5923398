"""Hot-swap: the versioned weight store, version sources (local store, MQTT announcements plus
HTTP fetches), the swapper, the control plane, and the acceptance log with the canary that rolls
a regression back. Imports the drafter, records and model layers below it; never the learner."""
