"""Transport between servers and the learner: the in-process record bus (`bus`, the embedded
default) and MQTT (`mqtt`: records up, live-version announcements down; `sequence`: the numbers
that let a learner count records lost on the way; `retirement`: ending a learner's session for
good). Imports only `specd.core`."""
