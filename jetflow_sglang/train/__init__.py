"""Training pipeline for JetFlow draft heads: regeneration (data), teacher features, losses, trainer."""
