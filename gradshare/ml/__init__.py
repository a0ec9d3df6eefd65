"""gradshare.ml: SharedTrainer as a Spark ML Estimator, and its Model as a Transformer.

    from gradshare.ml import GradshareEstimator
    model = Pipeline(stages=[VectorAssembler(...), StandardScaler(...), GradshareEstimator(factory)]).fit(df)
    model.transform(df)      # prediction (+ probability) columns, computed on the executors

estimator.py: the Estimator and its Params (params.py); model.py: the Model and its transform, whose
executor side is predict.py; persist.py: save/load.
"""

from gradshare.ml.estimator import GradshareEstimator
from gradshare.ml.model import GradshareModel

__all__ = ["GradshareEstimator", "GradshareModel"]
