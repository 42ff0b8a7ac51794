"""Channel 2, SDPO: error sites, hint insertion and hint sources (pure data preparation), and the
controller-side pass that scores the sites with the hinted teacher and trains on the JSD."""
