"""The drafter wing: a drafter version's lifecycle on the server, from LATEST to served, watched, kept or rolled back."""
