"""Transport between servers and the learner: the in-process record bus (`bus`, the embedded
default) and MQTT (`mqtt`: records up, live-version announcements down). Imports only `specd.core`."""
