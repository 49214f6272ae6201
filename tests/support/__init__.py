"""Helpers and pytest plugins shared by test modules of several rooms: public names, one home each."""
