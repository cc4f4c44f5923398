"""`specd demo`, the main job: a deployment in miniature (`deployment`) and its figures (`report`)."""
